"""
Drop-in package for compiler backend plugins (C{twisted.plugin}).

Any module here (or in a C{kcoral/plugins} directory elsewhere on
C{sys.path}) that provides L{kcoral.compilers.interfaces.ICompilerBackend}
objects is discovered by L{kcoral.compilers.backends}.
"""

from twisted.plugin import pluginPackagePaths

__path__.extend(pluginPackagePaths(__name__))
__all__: list[str] = []
