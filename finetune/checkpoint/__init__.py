"""Files that outlive a process: checkpoint folders written atomically and verified (store), each
strategy's weights and optimizer format (checkpointers), where a start resumes from (resume), disk reads
and writes tuned for large files (diskio), and the locks that keep two runs out of one folder (locks).

May import: config.
"""
