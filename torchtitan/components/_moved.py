"""The import paths of modules that moved into subsystem packages (release 0.x): each old path keeps working for
one release, with a DeprecationWarning naming the new one. Remove this module (and its two callers) one release
after the move.

Two kinds of old path:
- a module that is gone (`torchtitan.components.checkpoint_folders`): a finder on `sys.meta_path` answers its
  import with the moved module itself (same object, so patching either name patches both);
- a module whose name is now its package's (`torchtitan.components.checkpoint`, once the manager module): the
  package's `__getattr__` hands out the moved module's names (`moved_attribute`).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

PACKAGE = "torchtitan.components"

# old module under components/ -> its new dotted path under components/
MOVED_MODULES = {
    "checkpoint_folders": "checkpoint.folders",
    "checkpoint_checksums": "checkpoint.checksums",
    "hf_folder": "checkpoint.hf_folder",
    "offline_model": "checkpoint.offline_model",
    "optimizer": "optim.optimizer",
    "lr_scheduler": "optim.lr_scheduler",
    "muon": "optim.muon",
    "muon_distributed": "optim.muon_distributed",
    "lora_export": "lora.export",
    "step_guard": "faults.step_guard",
    "replica_check": "faults.replica_check",
    "training_error": "faults.training_error",
    "hf_tokenizer": "tokenizer.hf_export",
}
# old module whose name its new package took -> the module that now holds its code
RENAMED_TO_PACKAGE = {
    "checkpoint": "checkpoint.manager",
    "lora": "lora.adapters",
    "tokenizer": "tokenizer.backends",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The moved module ran when it was imported under its new name; the import system has just set its
        # __spec__ to the old name's: give it back its own.
        module.__spec__ = self.own_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != PACKAGE or name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(f"{PACKAGE}.{MOVED_MODULES[name]}"))


def install_finder() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())


def moved_attribute(package: str, name: str):
    """`package.name` for a name that lived in the old module of the package's name (a package `__getattr__`)."""
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(name)  # dunders and the package's own submodules are not forwarded
    short = package.rpartition(".")[2]
    new = f"{PACKAGE}.{RENAMED_TO_PACKAGE[short]}"
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    return getattr(module, name)


def package_getattr(package: str, name: str):
    """`torchtitan.components.<old module>` as an attribute of the components package."""
    if name in MOVED_MODULES:
        _warn(f"{PACKAGE}.{name}", f"{PACKAGE}.{MOVED_MODULES[name]}")
        return importlib.import_module(f"{PACKAGE}.{MOVED_MODULES[name]}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
