"""`attach(model)`: saved activations go through the tiered store.

The saved-tensor hooks are active during the model's forward only. Each saved
tensor is classified once, at pack time:

- parameters and buffers (recognised by storage, so ``weight.t()`` is too),
  tensors that are not plain strided tensors (quantized and zero tensors
  included), lazily negated views, tensors on devices other than CPU/CUDA:
  returned as they are;
- tensors smaller than ``policy.min_tensor_bytes`` and tensors of kept layers:
  held as they are (counted as resident);
- everything else: its *storage* goes to the store once (two saved tensors on
  one storage are one entry), and unpack rebuilds the view with its offset,
  size, stride and conjugate bit.

The parts: ``offloader.py`` (hooks, pack, unpack), ``forward.py`` (the
forward's lifecycle per thread), ``entry.py`` (handles), ``registry.py`` (the live
entries), ``cpu.py``, ``cuda.py`` and ``cufile.py`` (transports), ``readahead.py``,
``adaptive.py``, ``settled.py``, ``profile.py``, ``recompute.py``, ``budget.py``,
``watch.py``, ``control.py``, ``layers.py``, ``shelf.py`` and ``stats.py``;
``owner.py`` holds what each part uses of the offloader, so none imports
``offloader.py``. docs/offloader.md maps them.
"""

from .forward import no_offload
from .layers import find_layers, find_stacks
from .offloader import Offloader, attach, attached, detach
from .shelf import reusing_stores
from .stats import OffloadStats

__all__ = [
    "OffloadStats",
    "Offloader",
    "attach",
    "attached",
    "detach",
    "find_layers",
    "find_stacks",
    "no_offload",
    "reusing_stores",
]
