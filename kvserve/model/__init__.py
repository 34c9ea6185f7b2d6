"""Models on paged KV: config (`config`), the decoder (`decoder`, `layers`,
`parallel`), attention over the KV cache (`attention`), weight loading
(`loader`, `gguf_loader`); sampling lives in `kvserve.sample`."""
