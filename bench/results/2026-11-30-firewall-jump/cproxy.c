// cproxy: a minimal single-threaded, edge-triggered epoll TCP proxy, as a
// yardstick. Listens on :18080, connects each client to BACKEND:8080.
// Per message: read into a buffer, write to the peer; leftovers wait for
// EPOLLOUT. EOF: shutdown(SHUT_WR) the peer; both EOFs: close both.
// With CPROXY_REUSEPORT set (added for 2026-12-01-ceiling), the listener takes
// SO_REUSEPORT, so that several processes can share the port.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <signal.h>

#define BUFSZ 16384
struct side;
struct conn {
	int fd[2];
	int eof[2], done[2];
	char *pend[2]; // bytes read from side d not yet written to 1-d
	int plen[2], poff[2];
	int closed;
};
struct side { struct conn *c; int i; };
static struct side *sides[65536];
static int ep;
static char buf[BUFSZ];

static void closeconn(struct conn *c) {
	for (int i = 0; i < 2; i++) {
		close(c->fd[i]);
		free(sides[c->fd[i]]);
		sides[c->fd[i]] = NULL;
		free(c->pend[i]);
	}
	free(c);
}

// pump moves direction d (fd[d] -> fd[1-d]); returns -1 if c was closed.
// hup: the event said the source has hung up, so a short read is not the
// end of what it has (its EOF is still to be read: edge-triggered epoll
// will not report it again).
static int pump(struct conn *c, int d, int hup) {
	int src = c->fd[d], dst = c->fd[1 - d];
	for (;;) {
		if (c->plen[d] > c->poff[d]) {
			ssize_t w = write(dst, c->pend[d] + c->poff[d], c->plen[d] - c->poff[d]);
			if (w < 0) {
				if (errno == EAGAIN) return 0;
				closeconn(c); return -1;
			}
			c->poff[d] += w;
			if (c->poff[d] < c->plen[d]) return 0;
			c->plen[d] = c->poff[d] = 0;
		}
		if (c->eof[d]) {
			if (!c->done[d]) {
				c->done[d] = 1;
				if (c->done[1 - d]) { closeconn(c); return -1; }
				shutdown(dst, SHUT_WR);
			}
			return 0;
		}
		ssize_t n = read(src, buf, BUFSZ);
		if (n < 0) {
			if (errno == EAGAIN) return 0;
			closeconn(c); return -1;
		}
		if (n == 0) { c->eof[d] = 1; continue; }
		ssize_t w = write(dst, buf, n);
		if (w < 0) {
			if (errno != EAGAIN) { closeconn(c); return -1; }
			w = 0;
		}
		if (w < n) {
			if (!c->pend[d]) c->pend[d] = malloc(BUFSZ);
			memcpy(c->pend[d], buf + w, n - w);
			c->plen[d] = n - w; c->poff[d] = 0;
			return 0;
		}
		if (n < BUFSZ && !hup) return 0; // drained (a short read: nothing more now)
	}
}

static void add(int fd, struct conn *c, int i) {
	struct side *s = malloc(sizeof *s);
	s->c = c; s->i = i; sides[fd] = s;
	struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.fd = fd};
	epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

int main(int argc, char **argv) {
	signal(SIGPIPE, SIG_IGN); // a write to a closed peer fails with EPIPE instead
	const char *be = argc > 1 ? argv[1] : "10.244.0.10";
	struct sockaddr_in bea = {.sin_family = AF_INET, .sin_port = htons(8080)};
	inet_pton(AF_INET, be, &bea.sin_addr);
	int ln = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
	setsockopt(ln, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (getenv("CPROXY_REUSEPORT")) setsockopt(ln, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
	struct sockaddr_in la = {.sin_family = AF_INET, .sin_port = htons(18080)};
	if (bind(ln, (void *)&la, sizeof la) || listen(ln, 4096)) { perror("listen"); return 1; }
	ep = epoll_create1(0);
	struct epoll_event lev = {.events = EPOLLIN, .data.fd = ln};
	epoll_ctl(ep, EPOLL_CTL_ADD, ln, &lev);
	struct epoll_event evs[256];
	for (;;) {
		int n = epoll_wait(ep, evs, 256, -1);
		for (int k = 0; k < n; k++) {
			int fd = evs[k].data.fd;
			if (fd == ln) {
				for (;;) {
					int cfd = accept4(ln, NULL, NULL, SOCK_NONBLOCK);
					if (cfd < 0) break;
					int bfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
					setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
					setsockopt(bfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
					connect(bfd, (void *)&bea, sizeof bea);
					struct conn *c = calloc(1, sizeof *c);
					c->fd[0] = cfd; c->fd[1] = bfd;
					add(cfd, c, 0); add(bfd, c, 1);
				}
				continue;
			}
			struct side *s = sides[fd];
			if (!s) continue;
			struct conn *c = s->c;
			int hup = (evs[k].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
			if (pump(c, 0, hup && s->i == 0) < 0) continue;
			pump(c, 1, hup && s->i == 1);
		}
	}
}
