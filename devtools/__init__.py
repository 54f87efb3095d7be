"""Repository tools: generators that read and write this checkout's files (``bin/generate``) and the
checks the tests run on them. Not part of the installed package: nothing here works without a checkout."""
