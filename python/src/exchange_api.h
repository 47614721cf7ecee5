// DLPack 1.3's C exchange API for tensorshm tensors (`__dlpack_c_exchange_api__`).
#ifndef TENSORSHM_PYTHON_EXCHANGE_API_H_
#define TENSORSHM_PYTHON_EXCHANGE_API_H_

#include <dlpack/dlpack.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace tensorshm::python {

// The process-wide table; lives until exit.
const DLPackExchangeAPI* ExchangeApi();

// How often each entry has been called, for tests: allocator, managed_from_py,
// managed_to_py, dltensor_from_py, current_work_stream.
std::array<int64_t, 5> ExchangeApiCalls();
// The same, by the entries' names in DLPackExchangeAPI (_exchange_api_calls()).
std::map<std::string, int64_t> ExchangeApiCallsByName();

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_EXCHANGE_API_H_
