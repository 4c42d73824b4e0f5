"""Quality harness: `pellucid eval ppl` (perplexity through the engine) and `pellucid eval agree`
(greedy agreement and perplexity delta of one engine configuration against another). See docs/eval.md."""
