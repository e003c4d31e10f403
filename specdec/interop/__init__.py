"""Trained drafters in the layouts other runtimes load (vLLM, SGLang, speculators, the reference repos).

- `schema`: what each runtime's loader reads (config keys and types, tensor names and shapes), written
  from their source code (files and commits cited there), and `validate(folder, kind, layout)`.
- `eagle`: EAGLE-1/2 heads out to (and back from) the vLLM, SGLang and speculators layouts.
- `eagle3`: EAGLE-3 heads out to (and back from) the speculators format vLLM loads and SGLang's layout.
- `export`: `specdec export`, for the shipped drafters and any `specdec train` folder.

Nothing here runs vLLM or SGLang (neither is installed, nor can be here): a folder that validates has
the names, shapes and keys their loaders read, which is all that was checked. docs/interop.md says more.
"""
