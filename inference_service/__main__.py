"""python -m inference_service: the inference worker (its flags: server/main.py, or --help)."""

import os

from shared.huge_page_advice import advised

os.environ.update(advised(os.environ))  # before torch is imported: its allocator reads this once

from inference_service.server.main import main

if __name__ == "__main__":
    main()
