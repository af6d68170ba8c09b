"""LoRA and attention ops: each file holds one op, its plain torch reference and its fast paths."""
