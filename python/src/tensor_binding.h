// tensorshm.Tensor and tensorshm.WritableTensor: their properties, release, publish and repr
// (__dlpack__, the buffer protocol and the Arrow exports come from their own files).
#ifndef TENSORSHM_PYTHON_TENSOR_BINDING_H_
#define TENSORSHM_PYTHON_TENSOR_BINDING_H_

#include <nanobind/nanobind.h>

#include <map>
#include <string>
#include <tuple>

namespace tensorshm::python {

// Registers _RawStorage, Tensor and WritableTensor on `m`.
void DefineTensors(nanobind::module_& m);

// _dtype_fields(name): the (code, bits, lanes) of a tensorshm dtype name; raises
// InvalidArgumentError naming it if unknown.
std::tuple<int, int, int> DtypeFields(const std::string& name);
// _dtype_name(code, bits, lanes): the dtype's name; raises InvalidArgumentError if tensorshm has
// no such dtype.
std::string DtypeName(int code, int bits, int lanes);
// _triton_datatypes(): tensorshm dtype name -> Triton (KServe v2) datatype, for every dtype
// Triton has (common/tensor/dtype.cc's table).
std::map<std::string, std::string> TritonDatatypes();

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_TENSOR_BINDING_H_
