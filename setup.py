"""The compiled device path (broker/net/_devicelane.pyx, issue 23): built by
``pip install -e .`` with Cython (a build requirement in pyproject.toml). The rest of the
project is configured in pyproject.toml. The generated C and the built module are not
committed (.gitignore). Optional: where the C compiler fails (no compiler, another Python's
C API) mqlog still installs, and the broker runs the pure-Python device path
(broker/net/devicepath.py), saying so once in its log; ``make test`` fails then
(tests/unit/net/test_devicepath.py)."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("broker.net._devicelane", ["broker/net/_devicelane.pyx"], optional=True)],
        compiler_directives={"language_level": "3"},
    )
)
