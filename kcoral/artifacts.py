"""
The 0.1.1 package's module path for returned files and folders (kept for
scripts that import them from here); they live in L{kcoral.client.files}.
"""

from kcoral.client.files import ReturnedFile, ReturnedFolder

__all__ = ["ReturnedFile", "ReturnedFolder"]
