{
  "targets": [
    {
      "target_name": "keyfleet_kernel",
      "sources": ["native/kernel.c"],
      "cflags": ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
      "defines": ["NAPI_DISABLE_CPP_EXCEPTIONS"]
    }
  ]
}
