// PRUNEKIT_CHECK(cond, parts...): TORCH_CHECK with its message built by appending to a std::string instead of through
// std::ostringstream (c10::str).
//
// Why: on the GPU machine's image (torch 2.11+cu130 wheel built with gcc-toolset-13, extensions built with the system
// gcc 13.3 and its libstdc++), any std::ostringstream used inside an extension ended the process with a segmentation
// fault, so every TORCH_CHECK whose message had more than one part crashed instead of raising RuntimeError; a single
// C string, a std::string, snprintf and plain exceptions raised normally (scripts/abi_probe.py, 2026-11-26). The parts
// this takes: C strings, std::string, characters, booleans, integers, floating point, c10::ScalarType, c10::Device
// and c10::IntArrayRef (a tensor's sizes or strides). The message is built only when the check fails.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace prunekit {
namespace check_detail {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void put(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  s += buf;
}
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

}  // namespace check_detail

template <typename... Parts>
std::string check_message(const Parts&... parts) {
  std::string s;
  (check_detail::put(s, parts), ...);
  return s;
}

}  // namespace prunekit

#define PRUNEKIT_CHECK(cond, ...) TORCH_CHECK(cond, ::prunekit::check_message(__VA_ARGS__))
