// Text that came from a file (a .vqkv's metadata), made safe to print on a terminal.
#pragma once
#include <string>
#include <string_view>

namespace vqcli {

// `s` with every byte that could drive a terminal written as an escape: control characters (C0,
// DEL: \n, \t, \r, \x1b, ...; C1 as \u0085 etc.) and bytes that are not UTF-8 (\xff). A backslash
// becomes \\ so that an escape in the output always means an escaped byte. Printable UTF-8 (é, 中)
// is kept as it is.
std::string printable(std::string_view s);

}  // namespace vqcli
