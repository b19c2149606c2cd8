"""Import-only stand-in for torchvision (probe and test use): vLLM's qwen3_5.py imports qwen3_vl.py, whose
transformers image processors import torchvision at module load; every attribute here is an inert placeholder."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    """Stands for any torchvision class/function/enum; calling it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, item):
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stub: {self._name} called (image/video path is not available)")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())
__path__ = []  # noqa: F811  (package with only stubbed submodules)


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Placeholder(f"torchvision.{item}")


if __name__ == "__main__":
    print(__doc__)
