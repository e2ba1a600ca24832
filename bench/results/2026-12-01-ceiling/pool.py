import sys,re,statistics as st
def parse(f):
    rounds=[];cur=None;rec=None
    for l in open(f):
        m=re.match(r'proxy=(\S+) workload=(\S+) rate=(\d+)',l)
        if m:
            if m[1]=='haproxy': cur={}; rounds.append(cur)
            rec=dict(rate=int(m[3])); cur[m[1]]=rec; continue
        m=re.match(r' perf(\w): ([\d.]+),context-switches ([\d.]+),task-clock(?: (\d+),raw_syscalls)?',l)
        if m and rec is not None:
            rec[m[1]]=float(m[3])
            if m[4]: rec['sys']=int(m[4])
    return rounds
for w in ['rr','short']:
    rounds=[]
    for f in sys.argv[1:]:
        if f.endswith(w+'.txt'): rounds+=parse(f)
    print(f"## {w}: {len(rounds)} rounds")
    print("| proxy | rounds | median ratio to HAProxy | range | proxy CPU per op (µs, median) | system calls per op | CPUs busy (proxy+client+backend) |")
    order=['haproxy','uproxy','uproxyblock','uproxypeek','uproxy2p3','uproxy2','cproxy','cproxy2','uring','uring2','gouring','gouringraw']
    for p in order:
        rs=[r[p]['rate']/r['haproxy']['rate'] for r in rounds if p in r]
        if not rs: continue
        k=2 if p.endswith('2') and p!='uproxy2' else 1  # only one of two processes was counted
        cpu=[r[p]['P']*k/3.0/r[p]['rate']*1000 for r in rounds if p in r]
        sc=[r[p]['sys']*k/3.0/r[p]['rate'] for r in rounds if p in r]
        busy=[(r[p]['P']*k+r[p]['C']+r[p]['B'])/3000 for r in rounds if p in r]
        print(f"| {p} | {len(rs)} | {st.median(rs):.2f}× | {min(rs):.2f}–{max(rs):.2f} | {st.median(cpu):.1f} | {st.median(sc):.1f} | {st.median(busy):.2f} |")
