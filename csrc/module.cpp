// An empty Python module, so `import megatron_fsdp._C` loads the library and runs its
// TORCH_LIBRARY registrations; the ops themselves are reached through torch.ops.megatron_fsdp.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
