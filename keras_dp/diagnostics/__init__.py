"""What runs where and what it costs, told before and after running.

`memory` plans the bytes per device of the state and of one compiled step;
`describe` draws the mesh, the state's layout and a batch's; `timing` says
where an epoch's time went against the devices' peak; `compilation_cache`
keeps compiled programs on disk so a rerun pays no compile.
"""

from keras_dp.diagnostics import compilation_cache
from keras_dp.diagnostics import describe
from keras_dp.diagnostics import memory
from keras_dp.diagnostics import timing

__all__ = ["compilation_cache", "describe", "memory", "timing"]
