"""The artifact store: writing (`draftgraph build`), checking (manifest, listed files, checksums, paths) and
loading artifact directories of compiled code. It sits above the compiler (it fills a CompiledModels) and below
the runtime and the engine build, which call it; the compiler never imports it."""
