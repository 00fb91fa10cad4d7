#!/bin/bash
source /tests/common.sh
[ -x /srv/tool/count.sh ] && [ "$(/srv/tool/count.sh)" = "0" ] && score 1
score 0
