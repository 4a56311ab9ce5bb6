"""The compiled device path (broker/net/_devicelane.pyx, issue 23), the batch checksum
(broker/commitlog/_crc.pyx) and the small batch (broker/commitlog/_smallbatch.pyx): built by
``pip install -e .`` with Cython (a build requirement in pyproject.toml). The rest of the
project is configured in pyproject.toml. The generated C and the built module are not
committed (.gitignore). It needs a C compiler and the Python headers
(scripts/install-system-deps.sh installs them); a checkout run without the module built (on
PYTHONPATH, say) serves with the pure-Python device path (broker/net/devicepath.py), saying so
once in its log, and tests/unit/net/test_devicepath.py fails there. (``optional=True`` was
tried: setuptools' editable build still fails when the compiler does.)"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [
            Extension("broker.net._devicelane", ["broker/net/_devicelane.pyx"]),
            Extension("broker.commitlog._crc", ["broker/commitlog/_crc.pyx"], libraries=["z"]),
            Extension("broker.commitlog._smallbatch", ["broker/commitlog/_smallbatch.pyx"]),
        ],
        compiler_directives={"language_level": "3"},
    )
)
