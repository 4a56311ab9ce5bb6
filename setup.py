"""The compiled device path (broker/net/_devicelane.pyx, issue 23): built by
``pip install -e .`` with Cython (a build requirement in pyproject.toml). The rest of the
project is configured in pyproject.toml. The generated C and the built module are not
committed (.gitignore); without the module the broker runs the pure-Python device path
(broker/net/devicelane.py)."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("broker.net._devicelane", ["broker/net/_devicelane.pyx"])],
        compiler_directives={"language_level": "3"},
    )
)
