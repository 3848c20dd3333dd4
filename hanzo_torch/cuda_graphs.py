"""An alias of :mod:`hanzo_torch.decode_graphs` for code that imports ``hanzo_torch.cuda_graphs``
(``DecodeStep`` is public API): the same module object, so attributes set through either name are
seen by both."""
import sys

from . import decode_graphs

sys.modules[__name__] = decode_graphs
