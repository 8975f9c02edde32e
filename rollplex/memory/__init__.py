"""Phase-aware memory management: tagged regions, the phase plan, backends and the ledger."""

from .backend import AccountingBackend, TorchMemorySaverBackend, make_backend
from .config import MemoryConfig, activation_bytes
from .fit import Footprint, MemoryFit, optimizer_bytes
from .ledger import Ledger
from .manager import MemoryManager, MemoryRegionError, device_capacity, host_buffers, host_memory
from .plan import PHASES, TAGS, PhasePlan

__all__ = ["AccountingBackend", "Footprint", "Ledger", "MemoryConfig", "MemoryFit", "MemoryManager",
           "MemoryRegionError", "PHASES", "PhasePlan", "TAGS", "TorchMemorySaverBackend", "activation_bytes",
           "device_capacity", "host_buffers", "host_memory", "make_backend", "optimizer_bytes"]
