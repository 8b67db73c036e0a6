/* Confines the listeners of already-loaded shared objects to one address.
 *
 * Mooncake's Transfer Engine binds its handshake listener to INADDR_ANY and its TCP transport
 * to in6addr_any whatever local host it is given. confine_bind() rewrites, in the global
 * offset table of every loaded object whose path contains a given part, the slot of libc's
 * bind() to confined_bind(), which turns a wildcard address into the configured one (an IPv4
 * address on an IPv6 socket becomes its v4-mapped form). Other objects, and binds to a
 * specific address, are untouched. Linux/glibc, 64-bit ELF.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

static int target_family = 0;        /* AF_INET or AF_INET6 once configured */
static struct in_addr target_v4;
static struct in6_addr target_v6;    /* for AF_INET: the v4-mapped form */

static int confined_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (addr != NULL && target_family != 0) {
        if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
            struct sockaddr_in in = *(const struct sockaddr_in *)addr;
            if (in.sin_addr.s_addr == htonl(INADDR_ANY)) {
                if (target_family != AF_INET) {
                    errno = EADDRNOTAVAIL;
                    return -1;
                }
                in.sin_addr = target_v4;
                return bind(fd, (const struct sockaddr *)&in, sizeof in);
            }
        } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 in6 = *(const struct sockaddr_in6 *)addr;
            if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
                in6.sin6_addr = target_v6;
                return bind(fd, (const struct sockaddr *)&in6, sizeof in6);
            }
        }
    }
    return bind(fd, addr, len);
}

struct patch {
    const char *part;
    int patched;
    int failed;
};

static uintptr_t absolute(uintptr_t base, uintptr_t ptr) {
    /* glibc relocates most d_ptr values of a loaded object in place; others keep offsets */
    return ptr < base ? base + ptr : ptr;
}

static void patch_slot(uintptr_t slot, struct patch *p) {
    long page = sysconf(_SC_PAGESIZE);
    void *start = (void *)(slot & ~(uintptr_t)(page - 1));
    if (mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
        p->failed++;
        return;
    }
    *(void **)slot = (void *)confined_bind;
    p->patched++;
    /* a RELRO page goes back to read-only; a plain GOT page was writable anyway */
}

static void patch_relocations(uintptr_t base, const ElfW(Rela) *rela, size_t size,
                              const ElfW(Sym) *symtab, const char *strtab, struct patch *p) {
    for (size_t i = 0; i < size / sizeof(ElfW(Rela)); i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
        const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(rela[i].r_info)];
        if (strcmp(strtab + sym->st_name, "bind") == 0) patch_slot(base + rela[i].r_offset, p);
    }
}

static int visit(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct patch *p = data;
    if (info->dlpi_name == NULL || strstr(info->dlpi_name, p->part) == NULL) return 0;
    uintptr_t base = info->dlpi_addr;
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t relro_start = 0, relro_end = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(base + info->dlpi_phdr[i].p_vaddr);
        if (info->dlpi_phdr[i].p_type == PT_GNU_RELRO) {
            relro_start = base + info->dlpi_phdr[i].p_vaddr;
            relro_end = relro_start + info->dlpi_phdr[i].p_memsz;
        }
    }
    if (dyn == NULL) return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmprel_size = 0, rela_size = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
            case DT_SYMTAB: symtab = (const ElfW(Sym) *)absolute(base, dyn->d_un.d_ptr); break;
            case DT_STRTAB: strtab = (const char *)absolute(base, dyn->d_un.d_ptr); break;
            case DT_JMPREL: jmprel = (const ElfW(Rela) *)absolute(base, dyn->d_un.d_ptr); break;
            case DT_PLTRELSZ: jmprel_size = dyn->d_un.d_val; break;
            case DT_RELA: rela = (const ElfW(Rela) *)absolute(base, dyn->d_un.d_ptr); break;
            case DT_RELASZ: rela_size = dyn->d_un.d_val; break;
        }
    }
    if (symtab == NULL || strtab == NULL) return 0;
    int before = p->patched;
    if (jmprel != NULL) patch_relocations(base, jmprel, jmprel_size, symtab, strtab, p);
    if (rela != NULL) patch_relocations(base, rela, rela_size, symtab, strtab, p);
    if (p->patched > before && relro_end > relro_start) {
        /* as the dynamic linker protects RELRO: whole pages only, the last partial one
         * holds writable data */
        long page = sysconf(_SC_PAGESIZE);
        uintptr_t start = relro_start & ~(uintptr_t)(page - 1);
        uintptr_t end = relro_end & ~(uintptr_t)(page - 1);
        if (end > start) mprotect((void *)start, end - start, PROT_READ);
    }
    return 0;
}

/* Route bind() of every loaded object whose path contains `part` through confined_bind, with
 * wildcard addresses replaced by `host` (a numeric IPv4 or IPv6 address). Returns the number
 * of GOT slots rewritten, -1 for a host that is not a numeric address, -2 when a slot could
 * not be made writable. */
int confine_bind(const char *part, const char *host) {
    if (inet_pton(AF_INET, host, &target_v4) == 1) {
        memset(&target_v6, 0, sizeof target_v6);
        target_v6.s6_addr[10] = 0xff;
        target_v6.s6_addr[11] = 0xff;
        memcpy(&target_v6.s6_addr[12], &target_v4, 4);
        target_family = AF_INET;
    } else if (inet_pton(AF_INET6, host, &target_v6) == 1) {
        target_family = AF_INET6;
    } else {
        return -1;
    }
    struct patch p = {part, 0, 0};
    dl_iterate_phdr(visit, &p);
    return p.failed ? -2 : p.patched;
}
