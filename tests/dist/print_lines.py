"""Two or more ranks under torchrun each print many short JSON lines as fast as they can, into
the one output file they share. Usage (under torchrun): print_lines.py LINES"""

import json
import os
import sys

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    for i in range(int(sys.argv[1])):
        print(json.dumps({"rank": rank, "i": i}))
