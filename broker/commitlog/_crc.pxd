from libc.stdint cimport uint32_t


cdef uint32_t batch_crc_of(const unsigned char *batch, Py_ssize_t length) noexcept nogil
