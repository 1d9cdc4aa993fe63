"""The prewarmer service's place in the tree. Empty: the service that fills the L2/L3 embedding caches is not
built yet, and nothing runs or documents it."""
