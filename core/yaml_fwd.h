// Forward declarations for headers that declare a config struct's YAML section (read_yaml and
// write_yaml beside the struct) without making everything that includes them parse yaml-cpp.
#pragma once

namespace YAML {
class Emitter;
}  // namespace YAML

namespace kiln::yaml {
class MapReader;
}  // namespace kiln::yaml
