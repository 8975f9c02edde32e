"""Phase-aware memory management: tagged regions, the phase plan, backends and the ledger."""

from .backend import AccountingBackend, TorchMemorySaverBackend, make_backend
from .config import MemoryConfig, activation_bytes
from .ledger import Ledger
from .manager import MemoryManager, MemoryRegionError
from .plan import PHASES, TAGS, PhasePlan

__all__ = ["AccountingBackend", "Ledger", "MemoryConfig", "MemoryManager", "MemoryRegionError", "PHASES", "PhasePlan",
           "TAGS", "TorchMemorySaverBackend", "activation_bytes", "make_backend"]
