#!/usr/bin/env python3
"""Import cycles between the modules (files) of a crate's src folder.

Edges: every `use` path and every inline `crate::`/`super::` path outside comments, strings
and the `mod tests` block, resolved to the deepest module file that exists. An edge from a
module to one of its own descendants (`mod x;`, `pub use x::Item`) is the module tree, not a
dependency, and is not counted. Prints each cycle with its edges and the top-level module
graph; exits 1 if there is a cycle between files or between top-level modules.

Usage: .ci/import_cycles.py crates/weir-core/src [--strict]
"""
import os, re, sys
root = sys.argv[1]  # crates/weir-core/src
mods = {}  # module path tuple -> file
for dp, dn, fn in os.walk(root):
    for f in fn:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f); rel = os.path.relpath(p, root)[:-3].split(os.sep)
        if rel[-1] in ('mod', 'lib'): rel = rel[:-1]
        mods[tuple(rel)] = p
def strip(src):
    m = re.search(r'#\[cfg\(test\)\]\s*mod tests\s*\{', src)
    if m: src = src[:m.start()]
    out=[]; i=0; n=len(src)
    while i<n:
        c=src[i]
        if src.startswith('//',i):
            j=src.find('\n',i); i = n if j<0 else j; continue
        if src.startswith('/*',i):
            j=src.find('*/',i+2); i = n if j<0 else j+2; continue
        m=re.match(r'r(#*)"',src[i:])
        if m and (i==0 or not (src[i-1].isalnum() or src[i-1]=='_')):
            end='"'+m.group(1); j=src.find(end,i+len(m.group(0))); out.append('""'); i=j+len(end); continue
        if c=='"':
            j=i+1
            while j<n and src[j]!='"':
                j+= 2 if src[j]=='\\' else 1
            out.append('""'); i=j+1; continue
        if c=="'":
            m=re.match(r"'(\\.[^']*|[^\\'])'",src[i:])
            if m: out.append("' '"); i+=len(m.group(0)); continue
        out.append(c); i+=1
    return ''.join(out)
def expand(tree, prefix):
    tree = tree.strip()
    m = re.match(r'^(.*?)\{(.*)\}$', tree, re.S)
    if m:
        head = m.group(1).rstrip(':').strip()
        pre = prefix + ([s for s in head.split('::') if s] if head else [])
        depth=0; cur=''; out=[]
        for ch in m.group(2):
            if ch=='{': depth+=1
            if ch=='}': depth-=1
            if ch==',' and depth==0: out.append(cur); cur=''
            else: cur+=ch
        out.append(cur)
        res=[]
        for o in out:
            if o.strip(): res += expand(o, pre)
        return res
    tree = re.sub(r'\s+as\s+\w+$', '', tree)
    return [prefix + [s.strip() for s in tree.split('::') if s.strip()]]
def resolve(me, path):
    # me: module tuple; path: list of segments
    if not path: return None
    if path[0] == 'crate': base = (); rest = path[1:]
    elif path[0] == 'super':
        base = me
        rest = path
        while rest and rest[0]=='super': base = base[:-1]; rest = rest[1:]
    elif path[0] == 'self': base = me; rest = path[1:]
    else:
        # child module reference
        if me + (path[0],) in mods: base=me; rest=path
        else: return None
    best = base
    cur = base
    for s in rest:
        cur = cur + (s,)
        if cur in mods: best = cur
        else: break
    return best
edges = {m:set() for m in mods}
for me, p in mods.items():
    if me and me[-1]=='tests': continue
    src = strip(open(p).read())
    for u in re.finditer(r'\buse\s+([^;]+);', src):
        for path in expand(u.group(1), []):
            t = resolve(me, path)
            if t is not None and t != me: edges[me].add(t)
    for u in re.finditer(r'\b((?:crate|super)(?:::\w+)+)', src):
        t = resolve(me, u.group(1).split('::'))
        if t is not None and t != me: edges[me].add(t)
for m in list(edges):
    if m and m[-1]=='tests': del edges[m]
def name(m): return '/'.join(m) or 'lib'
ignore_parent = '--strict' not in sys.argv
def keep(a,b):
    if not ignore_parent: return True
    # an edge from a module to its own descendant is the module tree (mod, pub use)
    return not (len(b)>len(a) and b[:len(a)]==a)
# tarjan
idx={}; low={}; st=[]; on=set(); sccs=[]; c=[0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v]=low[v]=c[0]; c[0]+=1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in edges or not keep(v,w): continue
        if w not in idx: sc(w); low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        comp=[]
        while True:
            w=st.pop(); on.discard(w); comp.append(w)
            if w==v: break
        if len(comp)>1: sccs.append(comp)
for v in edges:
    if v not in idx: sc(v)
for comp in sccs:
    print('cycle:', end=' ')
    print(len(comp), sorted(name(m) for m in comp))
    cs=set(comp)
    for a in sorted(comp):
        for b in sorted(edges[a]):
            if b in cs and keep(a,b): print('   ', name(a),'->',name(b))
# top-level graph
top={}
for a,bs in edges.items():
    for b in bs:
        if a[:1]!=b[:1] and a and b: top.setdefault(a[0],set()).add(b[0])
print('TOP', {k:sorted(v) for k,v in sorted(top.items())})
# and no cycle between the top-level modules either (error, storage, source, sink, ...)
seen_top = {}
def top_cycle(v, path):
    seen_top[v] = 'open'
    for w in sorted(top.get(v, ())):
        if seen_top.get(w) == 'open': return path + [v, w]
        if w not in seen_top:
            found = top_cycle(w, path + [v])
            if found: return found
    seen_top[v] = 'done'
    return None
top_found = None
for v in sorted(top):
    if v not in seen_top:
        top_found = top_found or top_cycle(v, [])
if top_found:
    print('top-level cycle:', ' -> '.join(top_found))

sys.exit(1 if sccs or top_found else 0)
