"""pdcluster: a Mooncake-style disaggregated prefill/decode LLM serving cluster on Ray.

The subpackages are the repository's top-level folders (``engine/``, ``router/``, ...), installed
under this name by pyproject's ``package-dir``: ``pdcluster.engine``, ``pdcluster.router``, ...
"""

import os
import sys

__version__ = "0.1.0"

# Imported from a source checkout (PYTHONPATH=checkout, as benchmarks/startup.py runs a
# baseline tree): the subpackages are the folders beside this one, not those of whichever
# checkout is installed in the venv. An installed copy has them inside this folder instead.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and \
        os.path.isfile(os.path.join(_checkout, "engine", "__init__.py")):
    __path__.append(_checkout)
    # A process started in the checkout has its root on sys.path (`python -m`, and Ray's
    # workers, which take the driver's working directory), where its folders would shadow
    # installed packages of the same name, such as Hugging Face's `kernels` that transformers
    # imports: the root goes last (tests/conftest.py does the same for pytest).
    _at_root = [p for p in sys.path if os.path.abspath(p or os.curdir) == _checkout]
    sys.path[:] = [p for p in sys.path if p not in _at_root] + _at_root[:1]
    del _at_root
