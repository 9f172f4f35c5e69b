// Fuzz target: a JSONL dataset read with dotted keys, in both bad-line policies. Only kiln::Error
// may come out.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz/fuzz_input.h"
#include "trainer/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::trainer;
  const std::string path = kiln::fuzz::write_input("data.jsonl", data, size);
  for (BadLines policy : {BadLines::kError, BadLines::kSkip}) {
    JsonlOptions o;
    o.bad_lines = policy;
    if (size > 0 && data[0] % 2) {  // nested keys too
      o.keys.prompt = "x.prompt";
      o.keys.label = "x.answer.0";
      o.keys.data_source = "meta.source";
    }
    try {
      LoadReport report;
      (void)load_jsonl(path, o, &report);
    } catch (const kiln::Error&) {
    }
  }
  return 0;
}
