"""Co-scheduling of prefix work beside decode: the work queue and the admission controller."""

from .controller import AdmissionController, CoschedConfig
from .work import Chunk, WorkItem, WorkQueue

__all__ = ["AdmissionController", "Chunk", "CoschedConfig", "WorkItem", "WorkQueue"]
