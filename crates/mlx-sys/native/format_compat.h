// Force-included into mlx-c's C++ sources. mlx/c/private/io.h calls std::format, which GCC 12's
// libstdc++ lacks; this stand-in formats "{}" placeholders through ostream, all io.h needs.
#pragma once
#ifdef __cplusplus
#include <version>
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>
namespace std {
inline void perch_format_rest(ostringstream& out, string_view fmt) { out << fmt; }
template <typename T, typename... Rest>
void perch_format_rest(ostringstream& out, string_view fmt, const T& value, const Rest&... rest) {
  auto at = fmt.find("{}");
  if (at == string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, at) << value;
  perch_format_rest(out, fmt.substr(at + 2), rest...);
}
template <typename... Args>
string format(string_view fmt, const Args&... args) {
  ostringstream out;
  perch_format_rest(out, fmt, args...);
  return out.str();
}
} // namespace std
#endif
#endif
