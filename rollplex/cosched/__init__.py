"""Co-scheduling of prefix work beside decode: the work queue, the admission controller, prefix jobs
that run a unit at a time (on a sharded model as one sweep in lockstep with the other ranks), the decode
hook that launches them, and the phase timeline."""

from .controller import AdmissionController, CoschedConfig
from .prefix import PrefixJob
from .rows import PrefixRows
from .scheduler import CoScheduler
from .sharded import ShardedPrefix
from .timeline import Timeline
from .work import Chunk, WorkItem, WorkQueue

__all__ = ["AdmissionController", "Chunk", "CoScheduler", "CoschedConfig", "PrefixJob", "PrefixRows", "ShardedPrefix",
           "Timeline", "WorkItem", "WorkQueue"]
