"""The periodic refit of the motion prototypes (``vidq motion-refit``)."""
