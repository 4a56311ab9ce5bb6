// SPDX-License-Identifier: GPL-2.0
// mqlog's XDP filter: the cluster interface's packets classified before the kernel's stack
// sees them (DESIGN.md, "XDP filter"; loaded by broker/xdp/kernel.py with bcc).
//
// The numbers below (classes, verdicts, ports, the magic's four bytes from
// broker/cluster/gossip/codec.py) are passed by the loader as -D, from broker/xdp/classes.py.
// Classes:
//   gossip    UDP to GOSSIP_PORT           member + magic "MQGS": pass; else drop
//   raft      TCP to or from the Raft ports [RAFT_PORT_FIRST, RAFT_PORT_LAST] (the metadata
//             group's raft_port - 1, then one per worker)      member: pass; else drop
//   mqtt      TCP to a client listener port (MQTT_PORT_0..2; 0 = none)       pass
//   other     anything else over IPv4, and what is too short to classify       pass
//   fragment  a non-first IPv4 fragment: no L4 header to classify. Passed and counted: the
//             datagram it belongs to is reassembled only with its first fragment, which
//             carries the ports and the magic and was classified (and, from a stranger,
//             dropped) like any packet, so a stranger's fragments never reach a socket.
//   ipv6      passed and counted: this program filters IPv4 only (a cluster bound to an IPv6
//             address gets the user-space filter instead, broker/xdp/service.py).
// Verdicts: pass, drop_stranger (source not in `allowlist`), drop_bad_magic.
// Every packet is counted once, in packets and bytes, under (class, verdict), per CPU.

#include <uapi/linux/bpf.h>
#include <linux/in.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>

#define IP_MF_OFFSET_MASK 0x1FFF  // the fragment offset bits of frag_off

struct counter {
    u64 packets;
    u64 bytes;
};

// Keys: IPv4 source addresses in network byte order, as they sit in the header.
BPF_HASH(allowlist, u32, u8, ALLOWLIST_SIZE);
// [cluster] join_from: IPv4 networks whose hosts' gossip passes (a node joining later: the
// codec authenticates it, and the membership lets a stranger through only with a join).
struct v4_prefix {
    u32 prefixlen;
    u32 addr;  // network byte order
};
BPF_LPM_TRIE(join_from, struct v4_prefix, u8, JOIN_FROM_SIZE);
BPF_PERCPU_ARRAY(counters, struct counter, N_CLASSES * N_VERDICTS);

static __always_inline int account(u32 cls, u32 verdict, u64 bytes)
{
    u32 key = cls * N_VERDICTS + verdict;
    struct counter *c = counters.lookup(&key);
    if (c) {
        c->packets += 1;  // per-CPU slot: no other CPU writes it, no atomics needed
        c->bytes += bytes;
    }
    return verdict == VERDICT_PASS ? XDP_PASS : XDP_DROP;
}

static __always_inline int is_member(u32 saddr)
{
    return allowlist.lookup(&saddr) != NULL;
}

static __always_inline int may_join(u32 saddr)
{
    struct v4_prefix key = {32, saddr};
    return join_from.lookup(&key) != NULL;
}

static __always_inline int is_mqtt_port(u16 port)
{
    return (MQTT_PORT_0 && port == MQTT_PORT_0) || (MQTT_PORT_1 && port == MQTT_PORT_1) ||
           (MQTT_PORT_2 && port == MQTT_PORT_2);
}

static __always_inline int is_raft_port(u16 port)
{
    return port >= RAFT_PORT_FIRST && port <= RAFT_PORT_LAST;
}

int xdp_filter(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    u64 bytes = data_end - data;

    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end)
        return account(CLASS_OTHER, VERDICT_PASS, bytes);
    if (eth->h_proto == htons(ETH_P_IPV6))
        return account(CLASS_IPV6, VERDICT_PASS, bytes);
    if (eth->h_proto != htons(ETH_P_IP))
        return account(CLASS_OTHER, VERDICT_PASS, bytes);

    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > data_end)
        return account(CLASS_OTHER, VERDICT_PASS, bytes);
    if (ntohs(ip->frag_off) & IP_MF_OFFSET_MASK)
        return account(CLASS_FRAGMENT, VERDICT_PASS, bytes);
    u32 ihl = ip->ihl * 4;  // 20..60 bytes; less is a malformed header the stack drops
    if (ihl < sizeof(*ip))
        return account(CLASS_OTHER, VERDICT_PASS, bytes);
    void *l4 = (void *)ip + ihl;
    u32 saddr = ip->saddr;

    if (ip->protocol == IPPROTO_UDP) {
        struct udphdr *udp = l4;
        if ((void *)(udp + 1) > data_end)
            return account(CLASS_OTHER, VERDICT_PASS, bytes);
        if (udp->dest != htons(GOSSIP_PORT))
            return account(CLASS_OTHER, VERDICT_PASS, bytes);
        if (!is_member(saddr) && !may_join(saddr))
            return account(CLASS_GOSSIP, VERDICT_DROP_STRANGER, bytes);
        unsigned char *magic = (unsigned char *)(udp + 1);
        if ((void *)(magic + 4) > data_end)
            return account(CLASS_GOSSIP, VERDICT_DROP_BAD_MAGIC, bytes);
        if (magic[0] != MAGIC_0 || magic[1] != MAGIC_1 || magic[2] != MAGIC_2 ||
            magic[3] != MAGIC_3)
            return account(CLASS_GOSSIP, VERDICT_DROP_BAD_MAGIC, bytes);
        return account(CLASS_GOSSIP, VERDICT_PASS, bytes);
    }
    if (ip->protocol == IPPROTO_TCP) {
        struct tcphdr *tcp = l4;
        if ((void *)(tcp + 1) > data_end)
            return account(CLASS_OTHER, VERDICT_PASS, bytes);
        u16 dport = ntohs(tcp->dest);
        // A reply on a connection this node opened to a peer's Raft port comes from it.
        if (is_raft_port(dport) || is_raft_port(ntohs(tcp->source))) {
            if (!is_member(saddr))
                return account(CLASS_RAFT, VERDICT_DROP_STRANGER, bytes);
            return account(CLASS_RAFT, VERDICT_PASS, bytes);
        }
        if (is_mqtt_port(dport))
            return account(CLASS_MQTT, VERDICT_PASS, bytes);
    }
    return account(CLASS_OTHER, VERDICT_PASS, bytes);
}
