"""`python -m jgrpo.generate --model PATH --prompt "..."`: print a checkpoint's completions.

The library function is `jgrpo.generate` (defined in jgrpo/generation.py); this module is only
the command-line entry point.
"""

from jgrpo.generation import main

if __name__ == "__main__":
    main()
