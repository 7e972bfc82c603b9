"""
The built-in compiler backends, found by C{getPlugins(ICompilerBackend, kcoral.plugins)}.
"""

from kcoral.compilers.nvcc import NvccBackend
from kcoral.compilers.sourcemodule import SourceModuleBackend
from kcoral.compilers.tvmffi import TvmFfiBackend

nvcc = NvccBackend()
sourcemodule = SourceModuleBackend()
tvmffi = TvmFfiBackend()
