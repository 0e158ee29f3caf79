"""bloomnative: train BLOOM-architecture language models on native PyTorch."""
