/* Everything the bindings are generated from. cudaTypedefs.h gives one PFN_* typedef per
   entry point and ABI version; the run-time table is typed with those. compat.h adds the
   few the table needs that a 12.x header lacks. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include "compat.h"
