"""Worker pools and canary release.

A video worker joins one pool (``vidq worker --pool NAME``, default ``stable``) and takes only that pool's queues
(shared/queues.py). Every job is routed to one pool when it is submitted and renders there:

- ``rules``: the routing decision (a header, a tenant's assignment, a split by a stable hash of the job id), pure;
- ``live``: which pools have a live worker (workers announce their pool through the broker's Redis);
- ``store``: the rules in Postgres and what operators do to them (set a split, promote, roll back, assign a tenant),
  the re-routing of a pool's queued jobs to ``stable``, and the side-by-side figures of ``vidq pools compare``;
- ``breaker``: a pool whose jobs fail too often is taken out of routing (run by the sweeper).

``stable`` is the fallback: it is always routable and takes every job no other rule sends elsewhere.
"""
