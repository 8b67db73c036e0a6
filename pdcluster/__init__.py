"""pdcluster: a Mooncake-style disaggregated prefill/decode LLM serving cluster on Ray.

The subpackages are the repository's top-level folders (``engine/``, ``router/``, ...), installed
under this name by pyproject's ``package-dir``: ``pdcluster.engine``, ``pdcluster.router``, ...
"""

import os

__version__ = "0.1.0"

# Imported from a source checkout (PYTHONPATH=checkout, as benchmarks/startup.py runs a
# baseline tree): the subpackages are the folders beside this one, not those of whichever
# checkout is installed in the venv. An installed copy has them inside this folder instead.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and \
        os.path.isfile(os.path.join(_checkout, "engine", "__init__.py")):
    __path__.append(_checkout)
