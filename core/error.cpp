// kiln::Error lives in the header; this file keeps the library non-empty and anchors the vtable.
#include "core/error.h"
