"""The render package: model registry, pipeline stages and video encoding. The one part of ``shared`` that needs
torch and diffusers (the ``worker`` extra); the video worker and the prewarmer import it, the API never does."""
