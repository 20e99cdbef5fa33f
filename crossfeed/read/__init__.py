"""Reading (layer 3, beside `write`): `options` (the one `LoaderOptions`), `loader` (the pipeline), `stages/` (sampler → frames → decode → batch), `sources/`, `executors/` and `tools/`."""
