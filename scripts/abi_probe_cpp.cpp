// Six ops that fail on purpose, for scripts/abi_probe.py (which ways of raising from an extension work here).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <cstdio>
#include <sstream>
#include <string>
namespace {
at::Tensor v1(const at::Tensor& x) { std::string s = "std::string c_str"; s += "!"; TORCH_CHECK(false, s.c_str()); return x; }
at::Tensor v2(const at::Tensor& x) { std::ostringstream o; o << "ostringstream " << 5; TORCH_CHECK(false, o.str().c_str()); return x; }
at::Tensor v3(const at::Tensor& x) { char buf[64]; std::snprintf(buf, sizeof buf, "snprintf %d", 5); TORCH_CHECK(false, buf); return x; }
at::Tensor v4(const at::Tensor& x) { TORCH_CHECK(false, std::string("std::string arg")); return x; }
at::Tensor v5(const at::Tensor& x) { throw std::runtime_error("plain runtime_error"); return x; }
at::Tensor v6(const at::Tensor& x) { TORCH_CHECK(false, "int ", int64_t{5}); return x; }
}
TORCH_LIBRARY(abi_c, m) {
  m.def("v1(Tensor x) -> Tensor"); m.def("v2(Tensor x) -> Tensor"); m.def("v3(Tensor x) -> Tensor");
  m.def("v4(Tensor x) -> Tensor"); m.def("v5(Tensor x) -> Tensor"); m.def("v6(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(abi_c, CUDA, m) { m.impl("v1", &v1); m.impl("v2", &v2); m.impl("v3", &v3); m.impl("v4", &v4); m.impl("v5", &v5); m.impl("v6", &v6); }
