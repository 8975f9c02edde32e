"""Phase-aware memory management: tagged regions, the phase plan, backends and the ledger."""

from .backend import AccountingBackend, TorchMemorySaverBackend, make_backend
from .ledger import Ledger
from .manager import MemoryManager, MemoryRegionError
from .plan import PHASES, TAGS, PhasePlan

__all__ = ["AccountingBackend", "Ledger", "MemoryManager", "MemoryRegionError", "PHASES", "PhasePlan", "TAGS",
           "TorchMemorySaverBackend", "make_backend"]
