"""Engine adapters (SGLang, vLLM): each imports its engine lazily; the core never imports them."""
