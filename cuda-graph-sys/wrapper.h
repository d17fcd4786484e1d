/* Everything the bindings are generated from. cudaTypedefs.h gives one PFN_* typedef per
   entry point and ABI version; the run-time table is typed with those. */
#include <cuda.h>
#include <cudaTypedefs.h>
