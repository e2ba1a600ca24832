# Summarises ceil.sh output: per run, the rate, each process's CPU per request (perf stat task-clock over 3 s),
# the proxy's system calls per request and the CPUs busy. Usage: python3 ceilsum.py ceil.WORKLOAD.txt ...
import sys,re
for f in sys.argv[1:]:
    cur=None
    for l in open(f):
        m=re.match(r'proxy=(\S+) workload=(\S+) rate=(\d+) window=([\d.]+)',l)
        if m: cur=dict(p=m[1],rate=int(m[3]),win=float(m[4])); continue
        m=re.match(r' perf(\w): ([\d.]+),context-switches ([\d.]+),task-clock(?: (\d+),raw_syscalls)?',l)
        if m and cur:
            cur[m[1]]=float(m[3]); 
            if m[4]: cur['sys']=int(m[4])
            if m[1]=='B':
                r=cur['rate']; w=3.0
                tot=cur['P']+cur['C']+cur['B']
                print(f"{cur['p']:8} rate={r:6} proxy={cur['P']/w/r*1000:6.1f}us client={cur['C']/w/r*1000:6.1f}us backend={cur['B']/w/r*1000:6.1f}us sys/op={cur['sys']/w/r:5.1f} busy(P+C+B)={tot/w/1000:4.2f}cpu")
