"""Import SGLang modules from the unpacked wheel on a CPU machine without SGLang's dependencies.

For subprocesses of the conformance tests only (it changes the import system of the process):
`install(root)` makes `import sglang.srt.<module>` load the wheel's files without running the
`sglang` package `__init__` (which pulls in FlashInfer and the whole runtime), and turns every import
of a module that is not installed, made from a file of the wheel, into an empty stub module whose
attributes are inert placeholders (orjson, zmq, triton, ...). torch, transformers, numpy and the
standard library are the installed ones. What imports this way (server_args, utils.common) runs
SGLang's real code for everything that does not touch a stubbed module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path


class _Inert:
    """Stands for any attribute of a stubbed module: callable, indexable, iterable (empty), falsy."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __getitem__(self, key):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # probably a class: subclassing and isinstance must work
            cls = type(name, (), {"__init__": lambda self, *a, **k: None, "__module__": self.__name__})
            setattr(self, name, cls)
            return cls
        return _Inert()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: str) -> None:
        self.src = src
        self.stubbed: set[str] = set()

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sglang":
            return None
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.src):
            return None  # only imports made by the wheel's own files are stubbed
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None
            except Exception:  # noqa: BLE001 - a broken finder must not decide
                continue
        self.stubbed.add(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install(root: Path) -> _StubFinder:
    """Set up this process to import `sglang.srt.*` from `root` (see `sglang_wheel.fetch`)."""
    src = str(Path(root) / "src")
    sys.path.append(str(Path(root) / "site"))
    finder = _StubFinder(src)
    sys.meta_path.append(finder)
    for name in ("sglang", "sglang.srt"):
        package = types.ModuleType(name)
        package.__path__ = [str(Path(src, *name.split(".")))]
        sys.modules[name] = package
    return finder
