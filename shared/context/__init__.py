"""What a video is about: keyframe embeddings (similar-video search) and motion tokens with their prototypes (motion
filters). Computed by the worker after a job has succeeded, never on the way to its MP4 or webhook."""
